//! (calibration)
