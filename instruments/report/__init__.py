"""The accuracy study's half of the report: seeds paired with their baselines, verdicts read
from intervals, the goal and the recommendation rule, the notes' placeholders, time accounts.
The run-comparison report users run on their own runs is ``rcnn_dropit.report``."""
