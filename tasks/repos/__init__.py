"""Repositories for grading: mirrors and pooled worktrees (`worktrees`), candidate patches
(`patching`) and the built test environments of a repository (`environments`)."""
