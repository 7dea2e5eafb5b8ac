"""Debian packages a test needs (Slurm, munge, sshd, pdsh): installed with apt-get where they are missing
and apt-get can run (CI's fresh machine, as root), else the test skips with why."""

from __future__ import annotations

import shutil
import subprocess


def apt_install(packages, missing) -> str | None:
    """Install Debian ``packages`` when ``missing()`` says something is; why not, in one line, or None."""
    if missing() is None:
        return None
    if not shutil.which("apt-get"):
        return f"{missing()}; apt-get is not available to install {' '.join(packages)}"
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    install = ["apt-get", "-o", "DPkg::Lock::Timeout=120", "install", "-y", "--no-install-recommends", *packages]
    for argv in (["apt-get", "update"], install):
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        except subprocess.TimeoutExpired:
            return f"{missing()}; {' '.join(argv)} took over 300 s"
        if proc.returncode != 0:
            return f"{missing()}; {' '.join(argv)} failed: {proc.stderr.strip()[-300:]}"
    return missing()
