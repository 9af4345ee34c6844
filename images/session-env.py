#!/usr/bin/env python3
"""Write this container's environment where an SSH session into it reads it.

sshd does not hand its own environment to a session: a session starts with sshd's defaults
(PATH=/usr/bin:/bin...), so without this `ssh node python` would miss the image's venv, its
DeepSpeed accelerator, the CUDA library path, and the NCCL_* / GPUCTL_* variables the vendor
set on the container. Vast.ai's SSH runtypes even replace the image's entrypoint with a plain
`sshd -D`. So the image runs this twice: at build time (the image's ENV) and from the entrypoint
at start (ENV plus what the vendor passed), writing three files, one per way a session is set up:

  /etc/ssh/sshd_config.d/gpuctl-env.conf  `SetEnv`: every session of an sshd started after it
                                           was written, PAM or not (OpenSSH >= 8.7)
  /etc/environment                        pam_env (UsePAM yes, the Debian/Ubuntu default); a
                                           vendor's `env >> /etc/environment` adds to it
  /etc/profile.d/gpuctl-env.sh            login shells (Debian's /etc/profile resets PATH first)

Only the variables a trainer session needs are written (SESSION_NAMES / SESSION_PREFIXES), and
never one whose name looks like a secret: the vendor's environment holds API keys, and these
files are world-readable. `--root DIR` writes under DIR instead of / (tests).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

SESSION_NAMES = {"PATH", "LD_LIBRARY_PATH", "LIBRARY_PATH", "VIRTUAL_ENV", "DS_ACCELERATOR", "LANG", "LC_ALL", "TZ"}
SESSION_PREFIXES = ("PYTHON", "NCCL_", "GPUCTL_", "CUDA_", "NVIDIA_", "HF_", "OMP_", "RUNPOD_", "VAST_")
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.I)
BEGIN, END = "# >>> gpuctl session environment (gpuctl-session-env) >>>", "# <<< gpuctl session environment <<<"
PLAIN = re.compile(r"[^\"\\\n$`]*")  # what /etc/environment and SetEnv can hold inside double quotes

SSHD_CONF = "etc/ssh/sshd_config.d/gpuctl-env.conf"
PAM_ENV = "etc/environment"
PROFILE = "etc/profile.d/gpuctl-env.sh"


def session_vars(environ: dict[str, str]) -> dict[str, str]:
    """The variables an SSH session should see, sorted by name."""
    picked = {
        name: value
        for name, value in environ.items()
        if (name in SESSION_NAMES or name.startswith(SESSION_PREFIXES))
        and not SECRET.search(name)
        and "\n" not in value
    }
    return dict(sorted(picked.items()))


def sshd_conf(env: dict[str, str]) -> str:
    # sshd keeps the first SetEnv line it reads and ignores later ones: everything goes on one
    plain = [f'"{k}={v}"' for k, v in env.items() if PLAIN.fullmatch(v)]
    head = "# written by gpuctl-session-env: the container's environment for every SSH session\n"
    return head + (f"SetEnv {' '.join(plain)}\n" if plain else "")


def pam_environment(env: dict[str, str], current: str) -> str:
    """/etc/environment with our block replaced; lines others wrote (a vendor's) are kept."""
    kept, inside = [], False
    for line in current.splitlines():
        if line == BEGIN:
            inside = True
        elif line == END:
            inside = False
        elif not inside:
            kept.append(line)
    block = [BEGIN, *(f'{k}="{v}"' for k, v in env.items() if PLAIN.fullmatch(v)), END]
    return "\n".join(block + kept) + "\n"


def profile(env: dict[str, str]) -> str:
    lines = ["# written by gpuctl-session-env: the container's environment for login shells"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def write(path: Path, text: str) -> None:
    """Whole or not at all: a session that starts meanwhile reads the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/", help="write under this folder instead of /")
    args = parser.parse_args(argv)
    root = Path(args.root)
    env = session_vars(dict(os.environ))
    write(root / SSHD_CONF, sshd_conf(env))
    pam = root / PAM_ENV
    write(pam, pam_environment(env, pam.read_text() if pam.exists() else ""))
    write(root / PROFILE, profile(env))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
