"""Evaluation harness (loss by rank, throughput, goodput; tables and plots): to come."""
