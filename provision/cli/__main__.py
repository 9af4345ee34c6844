"""`python -m provision.cli`: the same as the `gpuctl` command."""

from provision.cli.app import main

main()
