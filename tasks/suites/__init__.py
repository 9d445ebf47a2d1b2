"""Where suites come from: suite files (`dataset`) read with limits (`input_limits`,
`jsonl`), suites kept in git (`git_suite`), and importers of public benchmarks."""
