"""Studies: grids of pipeline runs over seeds, their statistics, MLflow tracking and tuning.

* ``spec``      the study YAML (``StudyConfig``): base run config, factors, seeds, baseline, metrics
* ``grid``      a study's cells and resolved per-run configs, validated before anything starts
* ``runner``    materialise each distinct dataset / layout once, train every cell x seed, resume
* ``results``   one row per run from the training outputs (summary.json + metrics.jsonl)
* ``stats``     mean, std, 95% CI over seeds per cell, Welch's t-test against the baseline
* ``tracking``  MLflow: a parent run per study, a child run per cell x seed; plain training runs
* ``tune``      Optuna search (grid / random / TPE) with the trials run as Spark tasks
"""
