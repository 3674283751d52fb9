"""What a run reports: metric writers, the run record, goodput, profiles and HLO reading."""
