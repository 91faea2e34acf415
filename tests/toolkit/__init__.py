"""Tests of rcnn_dropit, the detection toolkit: config, data, models, engine, evaluation,
checkpoints, report, tools."""
