# Everything else is in pyproject.toml; this file exists because
# cffi_modules is a setuptools keyword with no pyproject.toml spelling.
from setuptools import setup

setup(
    cffi_modules=[
        "csrc/build_shmwheel.py:ffibuilder",  # the core the package ships
        "csrc/build_shmwheel.py:testing_ffibuilder",  # the same, with the test hooks, for the suite
    ]
)
