"""Plan: what to recompute, as policy over what :mod:`memfit.measure` records. Candidates and
costs from a ledger (``candidates``), an optimal MILP (``solver``), budgets (``budget``), the
result (``result``), and ``planner``: the search that solves, has each solution verified by
running it (:mod:`memfit.measure.verify`, on fake tensors or in a sandbox) and tightens or
excludes; ``distributed``: the same per rank. The search that combines plans with the other
levers is :mod:`memfit.levers`."""
