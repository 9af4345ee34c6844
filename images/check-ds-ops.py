#!/usr/bin/env python3
"""Build-time check: every DeepSpeed op the image was asked to prebuild is compiled in.

argv: DeepSpeed's build variable suffixes, as in PREBUILD_OPS (CPU_ADAM -> DS_BUILD_CPU_ADAM).
A requested op that DeepSpeed's setup skipped (incompatible, or a missing header) would be
JIT-compiled on every node at the first step instead: fail the build now.
"""

import sys

import deepspeed.git_version_info as info
from deepspeed.ops.op_builder.all_ops import ALL_OPS

wanted = {f"DS_BUILD_{name}" for name in sys.argv[1:]}
names = {builder.BUILD_VAR: op for op, builder in ALL_OPS.items()}
unknown = sorted(wanted - set(names))
missing = sorted(names[var] for var in wanted & set(names) if not info.installed_ops.get(names[var]))
if unknown or missing:
    sys.exit(f"DeepSpeed ({info.accelerator_name}): unknown ops {unknown}, not prebuilt {missing}")
print(f"DeepSpeed {info.version} ({info.accelerator_name}): prebuilt {sorted(names[v] for v in wanted)}")
