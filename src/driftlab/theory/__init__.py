"""Numerical checks of the cone geometry behind attention decay (persona-drift paper, Sec. 5 / App. A).

Modules: `cone` (Theorem 5.1), `wendel` (Proposition 5.2), `volume` (Proposition 5.3),
`embeddings` (Figure 7): each simulates and checks its claim; `driftlab.report.theory`
runs them all and writes the plots, tables and summary. Nothing is imported here, so
`import driftlab.theory` stays cheap; see docs/theory.md.
"""
