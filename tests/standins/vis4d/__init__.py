"""Stand-in for vis4d (see tests/standins/README.md)."""
