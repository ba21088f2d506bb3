"""Workflow code of past releases, frozen: runs those releases started replay through it, then
continue as new into today's code (docs/workflow-versioning.md, "Frozen releases")."""
