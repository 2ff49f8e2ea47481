//! Transports: where frames come from and go to. In-memory channels between device
//! threads and the host, byte streams (TCP, Unix sockets, anything `Read`/`Write`), and
//! files to record a run and replay it.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, IoSlice, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::frame::{HEADER_LEN, Header, RawFrame, read_frame};
use crate::sync::{AtomicBool, AtomicUsize, channel};
use crate::{Error, Result};

/// Makes a source's `next_frame` return soon (the seed's "send the shutdown header to
/// every device"): a channel gets the shutdown marker, a socket is closed for reading.
pub trait Stop: Send + Sync {
    /// Asks the source to end.
    fn stop(&self);
}

/// Where one device's frames come from.
pub trait Source: Send {
    /// The next frame; `Ok(None)` once the source has ended. `stream` is the source's
    /// index (for errors); frames longer than `max_payload` are refused before any
    /// allocation.
    fn next_frame(&mut self, stream: usize, max_payload: u32) -> Result<Option<RawFrame>>;

    /// The next frame if one is ready now, without waiting: `Ok(None)` if none is (or
    /// the source cannot tell without waiting, the default), errors as
    /// [`next_frame`](Self::next_frame)'s. A listener that has frames in hand takes
    /// what is ready this way and hands the burst to its worker at once.
    fn ready_frame(&mut self, stream: usize, max_payload: u32) -> Result<Option<RawFrame>> {
        let _ = (stream, max_payload);
        Ok(None)
    }

    /// A handle that ends this source.
    fn stopper(&self) -> Arc<dyn Stop>;

    /// For an in-process [`channel()`]: its receiving end, which a receiver's callback
    /// workers read themselves (no listener thread and no queue in between). `None`
    /// for every other source (the default).
    #[doc(hidden)]
    fn in_process(&self) -> Option<InProcess> {
        None
    }

    /// Whether its frames carry payload checksums to verify: a stream's do (bytes
    /// crossed a medium); an in-process channel's payloads move by pointer, so its
    /// frames carry none and the receiver checks nothing (true by default).
    fn checksummed(&self) -> bool {
        true
    }
}

/// Where a device writes its frames.
pub trait Sink: Send {
    /// Sends one frame. The payload is taken by value: a channel moves it to the host
    /// without copying; a stream writes it after the header and hands the buffer back
    /// (so the sender can reuse it).
    fn send(&mut self, header: Header, payload: Vec<u8>) -> Result<Option<Vec<u8>>>;

    /// Whether frames need a payload checksum: true for streams; an in-process
    /// channel moves the payload by pointer and needs none (true by default).
    fn checksummed(&self) -> bool {
        true
    }
}

impl<S: Sink + ?Sized> Sink for Box<S> {
    fn send(&mut self, header: Header, payload: Vec<u8>) -> Result<Option<Vec<u8>>> {
        (**self).send(header, payload)
    }

    fn checksummed(&self) -> bool {
        (**self).checksummed()
    }
}

impl<S: Source + ?Sized> Source for Box<S> {
    fn next_frame(&mut self, stream: usize, max_payload: u32) -> Result<Option<RawFrame>> {
        (**self).next_frame(stream, max_payload)
    }

    fn ready_frame(&mut self, stream: usize, max_payload: u32) -> Result<Option<RawFrame>> {
        (**self).ready_frame(stream, max_payload)
    }

    fn checksummed(&self) -> bool {
        (**self).checksummed()
    }

    fn stopper(&self) -> Arc<dyn Stop> {
        (**self).stopper()
    }

    fn in_process(&self) -> Option<InProcess> {
        (**self).in_process()
    }
}

// ---- in memory ------------------------------------------------------------------------

/// An in-memory link from a device thread to the receiver, holding at most `frames`
/// frames in flight. The receiver's callback workers read such channels themselves:
/// a frame waits in its channel, never in the receiver's queue, so the channel's
/// capacity is what bounds it (the byte budget bounds frames from other sources).
pub fn channel(frames: usize) -> (ChannelSink, ChannelSource) {
    let (tx, rx) = channel::bounded(frames.max(1));
    let stopped = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(ChannelStop { tx: tx.clone(), stopped: stopped.clone() });
    let sinks = Arc::new(Sinks { live: AtomicUsize::new(1), stopped: stopped.clone() });
    let reader = InProcess { rx, stopped, left: None };
    (ChannelSink { tx, sinks }, ChannelSource { reader, stop })
}

/// The device end of [`channel()`]. When the last clone of a channel's sink is gone
/// (a device done, or its thread unwound by a panic), the channel ends after the frames
/// sent before, as a stop ends it: the stopper's own sender would otherwise keep it open
/// and its reader waiting for ever.
#[derive(Debug)]
pub struct ChannelSink {
    tx: channel::Sender<RawFrame>,
    sinks: Arc<Sinks>,
}

/// How many clones of a channel's sink are alive.
#[derive(Debug)]
struct Sinks {
    live: AtomicUsize,
    stopped: Arc<AtomicBool>,
}

impl Clone for ChannelSink {
    fn clone(&self) -> ChannelSink {
        self.sinks.live.fetch_add(1, Ordering::SeqCst);
        ChannelSink { tx: self.tx.clone(), sinks: self.sinks.clone() }
    }
}

impl Drop for ChannelSink {
    fn drop(&mut self) {
        if self.sinks.live.fetch_sub(1, Ordering::SeqCst) == 1 {
            // No frame can come after this one's: end the channel after what it holds.
            end_channel(&self.sinks.stopped, &self.tx);
        }
    }
}

impl Sink for ChannelSink {
    fn send(&mut self, header: Header, payload: Vec<u8>) -> Result<Option<Vec<u8>>> {
        self.tx.send(RawFrame { header, payload }).map_err(|_| Error::Closed)?;
        Ok(None)
    }

    fn checksummed(&self) -> bool {
        false
    }
}

/// The host end of [`channel()`]: ends at a shutdown marker (a device's
/// [`Sender::shutdown`](crate::Sender::shutdown)), when stopped (after the frames it
/// held then), or once every clone of its sink is gone (after every frame they sent).
#[derive(Debug)]
pub struct ChannelSource {
    reader: InProcess,
    stop: Arc<ChannelStop>,
}

/// The receiving end of an in-process channel (see [`Source::in_process`]).
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct InProcess {
    pub(crate) rx: channel::Receiver<RawFrame>,
    stopped: Arc<AtomicBool>,
    /// Once stopped: how many more frames to take (those the channel held then).
    left: Option<usize>,
}

/// What an in-process channel has now.
pub(crate) enum Ready {
    /// The next frame.
    Frame(RawFrame),
    /// Nothing yet.
    Empty,
    /// Nothing more: stopped and drained, or every sender gone.
    Ended,
}

impl InProcess {
    /// The next frame without waiting.
    pub(crate) fn try_next(&mut self) -> Ready {
        if self.left.is_none() && self.stopped.load(Ordering::SeqCst) {
            // The cut: frames in the channel now are delivered, later ones are not.
            self.left = Some(self.rx.len());
        }
        if self.left == Some(0) {
            return Ready::Ended;
        }
        match self.rx.try_recv() {
            Ok(frame) => {
                if let Some(left) = &mut self.left {
                    *left -= 1;
                }
                Ready::Frame(frame)
            }
            Err(channel::TryRecvError::Empty) => Ready::Empty,
            Err(channel::TryRecvError::Disconnected) => Ready::Ended,
        }
    }
}

#[derive(Debug)]
struct ChannelStop {
    tx: channel::Sender<RawFrame>,
    stopped: Arc<AtomicBool>,
}

impl Stop for ChannelStop {
    fn stop(&self) {
        end_channel(&self.stopped, &self.tx);
    }
}

/// Ends an in-process channel after the frames it holds now: raises its flag (its
/// reader takes what the channel holds when it sees the flag, then ends) and wakes a
/// reader waiting on an empty channel with a shutdown marker. A full channel's reader
/// is not waiting: it sees the flag. Never blocks, so a worker that stops every source
/// (after an error) cannot wait on a channel only it drains.
fn end_channel(stopped: &AtomicBool, tx: &channel::Sender<RawFrame>) {
    stopped.store(true, Ordering::SeqCst);
    let _ = tx.try_send(RawFrame { header: Header::shutdown(), payload: Vec::new() });
}

impl ChannelSource {
    /// Frames waiting in the channel now.
    pub fn len(&self) -> usize {
        self.reader.rx.len()
    }

    /// Whether no frame waits in the channel now.
    pub fn is_empty(&self) -> bool {
        self.reader.rx.is_empty()
    }

    fn checked(frame: RawFrame, stream: usize, max_payload: u32) -> Result<Option<RawFrame>> {
        if frame.header.len > max_payload {
            return Err(Error::FrameTooLong {
                stream,
                consumer: frame.header.consumer,
                len: frame.header.len as u64,
                cap: max_payload as u64,
            });
        }
        Ok(Some(frame))
    }
}

impl Source for ChannelSource {
    fn next_frame(&mut self, stream: usize, max_payload: u32) -> Result<Option<RawFrame>> {
        match self.reader.try_next() {
            Ready::Frame(frame) => ChannelSource::checked(frame, stream, max_payload),
            Ready::Ended => Ok(None),
            // Wait for a frame (a stop sends a marker into an empty channel).
            Ready::Empty => match self.reader.rx.recv() {
                Ok(frame) => {
                    if let Some(left) = &mut self.reader.left {
                        *left = left.saturating_sub(1);
                    }
                    ChannelSource::checked(frame, stream, max_payload)
                }
                Err(_) => Ok(None),
            },
        }
    }

    fn ready_frame(&mut self, stream: usize, max_payload: u32) -> Result<Option<RawFrame>> {
        match self.reader.try_next() {
            Ready::Frame(frame) => ChannelSource::checked(frame, stream, max_payload),
            Ready::Empty | Ready::Ended => Ok(None),
        }
    }

    fn checksummed(&self) -> bool {
        false
    }

    fn stopper(&self) -> Arc<dyn Stop> {
        self.stop.clone()
    }

    fn in_process(&self) -> Option<InProcess> {
        Some(self.reader.clone())
    }
}

// ---- byte streams ------------------------------------------------------------------------

/// Frames read from any byte stream (a socket, a file, a pipe), through a buffer of
/// [`STREAM_BUFFER`] bytes: the frames a read brings in whole are taken without waiting
/// ([`Source::ready_frame`]), so a listener hands them to its worker as one burst.
pub struct StreamSource {
    reader: BufReader<Box<dyn Read + Send>>,
    stop: Arc<dyn Stop>,
}

/// The read buffer of a [`StreamSource`]: 16 frames of 4 KiB.
pub const STREAM_BUFFER: usize = 64 << 10;

struct NoStop;

impl Stop for NoStop {
    fn stop(&self) {}
}

struct TcpStop(Mutex<Option<TcpStream>>);

impl Stop for TcpStop {
    fn stop(&self) {
        if let Some(s) = self.0.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = s.shutdown(Shutdown::Read);
        }
    }
}

#[cfg(unix)]
struct UnixStop(Mutex<Option<std::os::unix::net::UnixStream>>);

#[cfg(unix)]
impl Stop for UnixStop {
    fn stop(&self) {
        if let Some(s) = self.0.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = s.shutdown(Shutdown::Read);
        }
    }
}

impl StreamSource {
    /// Frames from `reader`; it ends at end of stream (or a shutdown marker). Nothing can
    /// stop it early: use this for streams that end by themselves.
    pub fn new(reader: impl Read + Send + 'static) -> StreamSource {
        StreamSource::with_stop(reader, Arc::new(NoStop))
    }

    fn with_stop(reader: impl Read + Send + 'static, stop: Arc<dyn Stop>) -> StreamSource {
        let reader: Box<dyn Read + Send> = Box::new(reader);
        StreamSource { reader: BufReader::with_capacity(STREAM_BUFFER, reader), stop }
    }

    /// Frames from a TCP connection; stopping closes it for reading.
    pub fn tcp(stream: TcpStream) -> io::Result<StreamSource> {
        let stop = Arc::new(TcpStop(Mutex::new(Some(stream.try_clone()?))));
        Ok(StreamSource::with_stop(stream, stop))
    }

    /// Frames from a Unix-socket connection; stopping closes it for reading.
    #[cfg(unix)]
    pub fn unix(stream: std::os::unix::net::UnixStream) -> io::Result<StreamSource> {
        let stop = Arc::new(UnixStop(Mutex::new(Some(stream.try_clone()?))));
        Ok(StreamSource::with_stop(stream, stop))
    }

    /// Replays the frames recorded in a file.
    pub fn file(path: impl AsRef<Path>) -> io::Result<StreamSource> {
        Ok(StreamSource::new(File::open(path)?))
    }
}

impl Source for StreamSource {
    fn next_frame(&mut self, stream: usize, max_payload: u32) -> Result<Option<RawFrame>> {
        read_frame(&mut self.reader, stream, max_payload)
    }

    /// The next frame if its header is in the buffer and so is its payload (or the
    /// header alone is an error): reading it then waits for nothing.
    fn ready_frame(&mut self, stream: usize, max_payload: u32) -> Result<Option<RawFrame>> {
        let buffered = self.reader.buffer();
        let Some(head) = buffered.first_chunk::<HEADER_LEN>() else { return Ok(None) };
        let header = Header::decode(head, stream)?;
        let whole = header.len > max_payload || buffered.len() - HEADER_LEN >= header.len as usize;
        if !whole {
            return Ok(None);
        }
        read_frame(&mut self.reader, stream, max_payload)
    }

    fn stopper(&self) -> Arc<dyn Stop> {
        self.stop.clone()
    }
}

/// A TCP listener for device connections, each one a [`StreamSource`].
pub struct TcpSources {
    listener: TcpListener,
}

impl TcpSources {
    /// Listens on `addr`, or on a free loopback port when `None`: nothing outside this
    /// machine can connect unless an address says so.
    pub fn bind(addr: Option<SocketAddr>) -> io::Result<TcpSources> {
        let addr = addr.unwrap_or_else(|| SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
        Ok(TcpSources { listener: TcpListener::bind(addr)? })
    }

    /// The address devices connect to.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts `n` device connections, in order.
    pub fn accept(&self, n: usize) -> io::Result<Vec<StreamSource>> {
        (0..n).map(|_| StreamSource::tcp(self.listener.accept()?.0)).collect()
    }
}

/// Frames written to any byte stream: the header, then the payload, in one vectored
/// write where the stream supports it (no copy into a frame buffer).
pub struct StreamSink<W: Write + Send> {
    writer: W,
}

impl<W: Write + Send> StreamSink<W> {
    /// A sink over `writer` (wrap files and sockets in a `BufWriter` for small frames).
    pub fn new(writer: W) -> StreamSink<W> {
        StreamSink { writer }
    }

    /// Flushes buffered frames.
    pub fn flush(&mut self) -> Result<()> {
        self.writer.flush().map_err(|error| Error::Io { stream: 0, error })
    }

    /// The writer back.
    pub fn into_inner(self) -> W {
        self.writer
    }
}

impl StreamSink<BufWriter<TcpStream>> {
    /// A sink over a TCP connection.
    pub fn tcp(stream: TcpStream) -> StreamSink<BufWriter<TcpStream>> {
        let _ = stream.set_nodelay(true);
        StreamSink::new(BufWriter::with_capacity(64 << 10, stream))
    }
}

impl<W: Write + Send> Sink for StreamSink<W> {
    fn send(&mut self, header: Header, payload: Vec<u8>) -> Result<Option<Vec<u8>>> {
        let head = header.encode();
        write_all_vectored(&mut self.writer, &head, &payload)
            .map_err(|error| Error::Io { stream: 0, error })?;
        if header.consumer == crate::frame::SHUTDOWN {
            self.writer.flush().map_err(|error| Error::Io { stream: 0, error })?;
        }
        Ok(Some(payload))
    }
}

fn write_all_vectored(w: &mut dyn Write, head: &[u8], body: &[u8]) -> io::Result<()> {
    let (mut head, mut body) = (head, body);
    while !head.is_empty() || !body.is_empty() {
        let n = w.write_vectored(&[IoSlice::new(head), IoSlice::new(body)])?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let from_head = n.min(head.len());
        head = &head[from_head..];
        body = &body[n - from_head..];
    }
    Ok(())
}

// ---- record and replay --------------------------------------------------------------------

/// A source that writes every frame it yields to a file (replay it with
/// [`StreamSource::file`]).
pub struct Recording<S: Source> {
    inner: S,
    file: BufWriter<File>,
}

impl<S: Source> Recording<S> {
    /// Records `inner`'s frames to a new file at `path`; an existing file is refused
    /// (`io::ErrorKind::AlreadyExists`), never replaced.
    pub fn new(inner: S, path: impl AsRef<Path>) -> io::Result<Recording<S>> {
        Ok(Recording { inner, file: BufWriter::new(File::create_new(path)?) })
    }
}

impl<S: Source> Recording<S> {
    /// Writes `f` to the file (flushed after a shutdown marker).
    fn record(&mut self, stream: usize, f: &RawFrame) -> Result<()> {
        let io = |error| Error::Io { stream, error };
        // A file is a medium: its frames carry checksums, also those that came
        // through an in-process channel without one.
        let mut header = f.header;
        if !self.inner.checksummed() {
            header.crc = crc32c::crc32c(&f.payload);
        }
        write_all_vectored(&mut self.file, &header.encode(), &f.payload).map_err(io)?;
        if f.header.consumer == crate::frame::SHUTDOWN {
            self.file.flush().map_err(io)?;
        }
        Ok(())
    }
}

impl<S: Source> Source for Recording<S> {
    fn next_frame(&mut self, stream: usize, max_payload: u32) -> Result<Option<RawFrame>> {
        let frame = self.inner.next_frame(stream, max_payload)?;
        match &frame {
            Some(f) => self.record(stream, f)?,
            None => self.file.flush().map_err(|error| Error::Io { stream, error })?,
        }
        Ok(frame)
    }

    fn ready_frame(&mut self, stream: usize, max_payload: u32) -> Result<Option<RawFrame>> {
        let frame = self.inner.ready_frame(stream, max_payload)?;
        if let Some(f) = &frame {
            self.record(stream, f)?;
        }
        Ok(frame)
    }

    fn stopper(&self) -> Arc<dyn Stop> {
        self.inner.stopper()
    }

    fn checksummed(&self) -> bool {
        self.inner.checksummed()
    }
}
