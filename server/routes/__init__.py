"""The endpoints of `tandem serve`, one router per group: completions.py (OpenAI), jobs.py (the
job API), detect.py (vision), health.py (health and metrics)."""
