"""``python -m harts``: the ``harts`` command, for launchers that start modules
(``torchrun --nproc_per_node=N -m harts train CONFIG.toml``)."""

from harts.cli import main

if __name__ == "__main__":
    main()
