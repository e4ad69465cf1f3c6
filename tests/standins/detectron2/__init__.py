"""Stand-in for detectron2 (see tests/standins/README.md)."""
