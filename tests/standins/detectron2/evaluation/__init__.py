"""Stand-in for detectron2.evaluation."""
