"""Figures: positional encodings, attention maps, schedules, training curves."""
