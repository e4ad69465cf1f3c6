"""Stand-in for detectron2.data.samplers."""
