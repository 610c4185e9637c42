"""The results side of a self-chat run: metrics, Figure-3 plots and one HTML report per run.

    metrics.summarize_run(run_dir)  -> RunSummary (scores, per-round and overall summaries)
    html.write_report(run_dir)      -> run_dir/report.html (+ summary.csv, overall.csv, PNGs)
    tables.round_table(summary)     -> the drift table as strings (CLI and HTML share it)

Submodules are imported on use so `import driftlab` stays free of pandas and matplotlib.
"""
