"""Reading shards for training: the manifest, and a worker's Parquet directory as torch batches."""
