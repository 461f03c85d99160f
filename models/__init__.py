"""genrec.models: the generative recommender and its rooms.

This folder: the recommender itself (`model`: features + store + tower + heads), its
config tree (`config`, `config_loader`), the one place a job's modules are built (`build`),
rank info (`ranks`), the one id -> position lookup (`ids`), and the read side of a run
directory (`runs`: find, verify and load checkpoints).

Rooms:
    train/       the training loop, checkpoint writing, distributed set-up, schedule, progress
    serving/     artifact export and loading, the ranker (retrieve -> rank), HTTP server
    evaluation/  metrics, offline evaluation, reports, the validation the trainer calls

May import: `genrec.data`, `genrec.sparse`, `genrec.dense` and libraries. Imports point one
way: `serving/` and `evaluation/` never import `train/`, and nothing here imports
`genrec.scripts`.
"""
