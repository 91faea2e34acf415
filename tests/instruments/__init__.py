"""Tests of the measuring instruments (instruments/): benchmarks, gradient fidelity, the study."""
