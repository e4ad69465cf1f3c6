"""Stand-in for virtex (see tests/standins/README.md)."""
