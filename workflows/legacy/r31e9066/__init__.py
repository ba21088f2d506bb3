"""Release 31e9066's pool, class and node workflows, frozen (docs/workflow-versioning.md).

pool.py, node_class.py and node.py are that release's workflows/ files; types.py, crds.py,
messages.py, lifecycle.py, budget.py, conditions.py, demand.py and pools.py its tgp/ modules;
activities.py declares the activities it schedules. Copied verbatim, but for:
* imports, which point here (nothing here changes when tgp/ does);
* `extra="forbid"` is `extra="ignore"`: after the upgrade, signals and activity results come
  from today's code, with fields this release did not have;
* the handover calls, marked `# handover: not in 31e9066` (handover.py): no-ops while replaying.

Never edit these files otherwise: they are what the histories of tests/histories/31e9066/
replay through. Remove the package (and that directory) to retire the release."""
