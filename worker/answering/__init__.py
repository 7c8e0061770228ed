"""Record in, answer out: run the job on the engine, shape the records that answer it."""
