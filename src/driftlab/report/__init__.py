"""The results side: every figure and page, drawn from run directories (protocols never draw).

    metrics.summarize_run(run_dir)     -> RunSummary of a self-chat (scores, per-round and overall)
    html.write_report(run_dir)         -> run_dir/report.html (+ summary.csv, overall.csv, PNGs)
    tables.round_table(summary)        -> the drift table as strings (CLI and HTML share it)
    decay_figures.*                    -> attention decay (persona-drift paper Fig. 4, 8)
    sweep.write_sweep_report(run_dir)  -> sweep.csv, the trade-off figures (Fig. 5, 6), sweep.html
    calibration.write_calibration_figure(run_dir), pasta.write_pasta_figures(run_dir)
    theory.write_theory(out)           -> the cone-geometry checks with their plots and tables

Submodules are imported on use so `import driftlab` stays free of pandas and matplotlib.
"""
