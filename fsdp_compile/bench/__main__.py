"""``python -m fsdp_compile.bench``: the bench CLI (see fsdp_compile.bench.cli)."""

from fsdp_compile.bench.cli import main

# Spawned ranks import this module again as __mp_main__; only the launcher runs main().
if __name__ == "__main__":
    main()
