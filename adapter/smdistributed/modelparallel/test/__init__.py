"""smdistributed.modelparallel.test: testing helpers the public AWS BERT example imports."""
