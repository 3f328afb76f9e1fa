"""What a benchmark reports about the machine it ran on."""

from __future__ import annotations

import os
import platform

import cffi

import shmwheel


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else whatever platform knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info(**versions: str) -> dict[str, str | int | None]:
    """CPU, OS, Python, cffi and shmwheel, plus any other ``name=version`` given."""
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "cffi": cffi.__version__,
        **versions,
        "shmwheel": shmwheel.__version__,
    }
