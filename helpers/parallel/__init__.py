"""Everything that talks between ranks: collectives and their ledger (chapter 02), data parallelism and ZeRO
(03, 04), tensor, pipeline and context parallelism (05-07), mixture of experts and expert parallelism (08)."""
