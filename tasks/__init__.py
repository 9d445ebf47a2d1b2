"""Stage logic of the evalpipe pipeline: plain functions on the data model in `tasks.models`."""
