"""From graded samples to numbers: estimators and intervals (`stats`), the per-run and
per-slice figures (`aggregate`), the release gate (`gate`), judge calibration against
labels (`calibration`, `labels`) and pairwise comparison (`pairwise`)."""
