"""How answers are judged: comparisons and tolerances, hypothesis strategies and profiles, skip marks, the
outcomes a test ends with, and what counts as an unfilled stub."""
