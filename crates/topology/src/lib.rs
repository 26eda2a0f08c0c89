//! sysfs PCI/NUMA/NIC/GPU discovery, GPU-NIC distance classes, NIC assignment and NCCL_IB_HCA-style filters.
