"""Thin command-line entry points; the work is done in the library."""
