"""swiftk benchmarks: prompt sets (workloads), Hugging Face baselines, end-to-end comparisons, device bring-up."""
