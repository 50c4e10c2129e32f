"""Ingestion: raw sources (image datasets, ROOT files) -> Parquet with a schema from ``schemas/``."""
