"""System tests: reliability and faults, torchrun and distributed jobs, the GPU tier."""
