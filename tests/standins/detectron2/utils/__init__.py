"""Stand-in for detectron2.utils."""
