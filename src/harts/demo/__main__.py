"""``python -m harts.demo`` (what ``make demo`` runs): :func:`harts.demo.main`."""

from harts.demo import main

main()
