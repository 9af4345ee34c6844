"""gpuctl's node side: the DeepSpeed training program (`python -m trainer run.json`).

This package object stays light on purpose: the laptop side imports it (to ship a copy
with the run bundle, and for object-storage listing), so nothing here may import torch,
deepspeed or transformers at import time. The heavy modules are imported by __main__.
"""
