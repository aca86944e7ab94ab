"""What a person sees: per-step metrics in JSONL and W&B (`metrics_log`), the console lines, the
end-of-run summary and the figure (`report`), and the commands printed to run next (`commands`)."""
