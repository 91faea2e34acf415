"""Tests of dropit_core, the method library: torch (and torchvision models as test subjects) only,
nothing of the toolkit."""
