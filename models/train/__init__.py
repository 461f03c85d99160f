"""genrec.models.train: training a recommender.

The loop (`trainer`), stopping at a non-finite loss (`guards`), atomic multi-rank
checkpoints, RNG capture and stop signals (`checkpoint`), resuming with changed settings
and starting over (`resume`), process-group set-up under torchrun (`distributed`), the
dense optimizer and LR schedule (`schedule`), progress and metric logs (`progress`), the
training benchmark (`bench`), and the quality benchmarks on Beauty (`bench_quality`) and
ML-100K (`bench_quality_ml100k`).

May import: `genrec.models` (the recommender, config, build, runs), `evaluation/` (the
trainer validates), `genrec.data`, `genrec.sparse`, `genrec.dense`. Nothing outside this
room imports it except the command line.
"""
