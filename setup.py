# Everything else is in pyproject.toml; this file exists because
# cffi_modules is a setuptools keyword with no pyproject.toml spelling.
from setuptools import setup

setup(cffi_modules=["csrc/build_shmwheel.py:ffibuilder"])
