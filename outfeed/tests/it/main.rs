//! Public-API tests of meshwork-outfeed.

mod common;
mod faults;
mod props;
mod seed;
mod transports;
