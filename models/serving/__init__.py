"""genrec.models.serving: a trained model answering requests.

Checkpoint -> artifact (`export`), the versioned artifact format (`artifact`: tower
program, quantized tables, item index, manifest; loaded without pickle), the ranker
(`ranker`: encode history, retrieve top-K, rank with M-FALCON), the HTTP server (`server`)
and the serving benchmark (`bench`).

May import: `genrec.models` (the recommender, config, runs, ids), `genrec.data`,
`genrec.dense`. Never `train/`.
"""
