"""Thin spark-submit entry points: parse args -> config -> call the pipeline stage. No logic here."""
