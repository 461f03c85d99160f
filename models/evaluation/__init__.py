"""genrec.models.evaluation: how good a model is, measured like the literature.

Metric maths with bootstrap CIs (`metrics`), full-corpus retrieval ranks shared by the
trainer's validation and `genrec eval` (`validation`), offline evaluation of a checkpoint
or an artifact (`evaluate`) and its report (`report`).

May import: `genrec.models` (the recommender, config, runs, ids), `serving/` (to evaluate
an exported artifact), `genrec.data`. Never `train/`.
"""
