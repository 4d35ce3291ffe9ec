"""Plan: pure policy over plain data. Candidates and costs from a ledger
(``candidates``), an optimal MILP (``solver``), budgets (``budget``), the result
(``result``), and ``planner``, which verifies a solution by running it on fake tensors.
The search that combines plans with the other levers is :mod:`memfit.levers`."""
