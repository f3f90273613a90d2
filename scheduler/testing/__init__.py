"""What tests, benchmarks and the demo use to run the scheduler as a real process; not part of serving."""
