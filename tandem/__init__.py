"""The `tandem` command (tandem/cli.py), above every package it wires together."""
